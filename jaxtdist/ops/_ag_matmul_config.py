"""ag_matmul's typed configs, one per kernel variant: defaults, checks, search space
and tail planning.

Three kernels serve ag_matmul; each has its config type, holding only the
settings that kernel has (``AgMatmulConfig`` holds those all three share):

- ``AgPointerConfig`` ("pointer", TMA=False): pointer loads, SM producer
  programs that stage and pull (PRODUCER="sm") or push into peers' inboxes
  (PRODUCER="push"), optional split K (SPLIT_K) and one tile over all ranks'
  rows (ALL_ROWS, decode);
- ``AgTmaConfig`` ("tma", TMA=True, PRODUCER="sm"): the persistent kernel with
  TMA loads, fed by SM producers;
- ``AgCopyEngineConfig`` ("ce", TMA=True, PRODUCER="ce"): the persistent TMA
  kernel with every SM in the GEMM, fed by the copy engines, with a split-N or
  stream-K tail.

A ``config=`` dict selects the variant with TMA and PRODUCER (else the default
rule's pick stays); a key of another variant is refused (``replace``) unless its
value asks nothing (e.g. STREAM_K=False).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from jaxtdist.ops._config import (KernelConfig, Problem, block, check_setting, check_settings,
                                  setting)
from jaxtdist.ops._gemm_config import default_tiles
from jaxtdist.ops._shapes import next_pow2

# PRODUCER="ce": "parallel" pushes to every peer at once (a side stream each),
# "serial" to one peer after another (one stream), in the order the GEMM
# consumes them, so that the first peer's shard lands early. Serial is the
# copy engines' default: 186.9 vs 190.2 us at 1024/4096/4096, 1242.9 vs 1268.5
# at 2048/7168/8192 on 4 x H200, fewer slow rounds (docs/perf, run AA).
PUSH_ORDERS = ("parallel", "serial")
# "auto" cuts a tail when its runs are at most this fraction of a tile's K.
# Measured on 4 x H200 (docs/perf/ag_matmul_stream_k_*): runs of 0.34 of a
# tile gained 1.3%; runs of 0.58-0.89 lost 0.7-18% (the partials' round trip
# through L2 and a second pipeline fill cost more than the shorter wave saves,
# and a part-filled last wave runs faster than a full one).
_STREAM_K_AUTO_MAX_RUN = 0.35
# FLATTEN="auto" needs at least this many tiles per program on average. On 4 x
# H200 (docs/perf, run AS) flattening gained 0.2-1.1% at 3.9-13.6 tiles per SM
# and lost 3.3% at one tile per SM (decode, 128/4096/8192).
_FLATTEN_AUTO_MIN_TILES = 2
# "sm": producer programs stage and pull; "push": producer programs push into
# peers' heap inboxes (pointer kernel only); "ce": the copy engines push (TMA kernel).
PRODUCERS = ("sm", "push", "ce")
# At most this many rows over all ranks: the decode configs (one tile over all rows).
_DECODE_ROWS = {"gpu": 128, "cpu": 32}
# Decode: bytes of x per gather signal (fewer, larger chunks cost less than a
# flag per row once shards have several rows).
_DECODE_SIGNAL_BYTES = 64 << 10
# The pointer kernel's tiles, largest first.
_POINTER_TILES = ((128, 256), (128, 128), (128, 64), (64, 64))


def _prev_pow2(n: int) -> int:
    return 1 << max(0, int(n).bit_length() - 1)


def tma_misfit(m_shard: int, n: int, k: int, itemsize: int, block_m: int) -> str:
    """What a shape lacks for the TMA kernels ("": it fits). Row tiles must not cross
    into the next rank's rows; descriptor strides must be 16-byte multiples."""
    if m_shard % block_m:
        return f"m_shard={m_shard} to be a multiple of BLOCK_M={block_m}"
    if k * itemsize % 16:
        return f"rows of x ({k} elements) to be a multiple of 16 bytes"
    return f"rows of w ({n} elements) to be a multiple of 16 bytes" if n * itemsize % 16 else ""


@dataclasses.dataclass(frozen=True)
class _Selectors:
    """The keys of a config dict that pick the kernel variant (not fields of every
    variant: a variant's kernel is fixed)."""
    TMA: bool = False
    PRODUCER: str = setting("sm", choices=PRODUCERS, note="(SM producer programs that pull, "
                            "SM producer programs that push, or the copy engines)")


@dataclasses.dataclass(frozen=True)
class AgMatmulConfig(KernelConfig):
    """How ag_matmul runs one problem: the settings every variant has, and the rules
    that pick a variant (``default``, ``replace``). Instances are of a variant.

    Attributes:
      BLOCK_M, BLOCK_N, BLOCK_K: GEMM tile (powers of 2).
      GROUP_M: row tiles per group of the tile order (L2 reuse of w).
      NUM_COMM: SM producer programs (the interpreter's push programs for "ce").
      CHUNK_ROWS: rows per gather signal (0: one per BLOCK_M rows).
      COPY_BLOCK_C: columns per producer copy step.
      SCOPE: memory scope of the gather's signals ("sys" or "gpu").
      num_warps, num_stages: launch options.
    """
    OP: ClassVar[str] = "ag_matmul"
    TMA: ClassVar[bool]
    PRODUCER: ClassVar[str]

    BLOCK_M: int = block(128, low=1)
    BLOCK_N: int = block(128, low=1)
    BLOCK_K: int = block(64, low=1)
    GROUP_M: int = setting(8)
    NUM_COMM: int = setting(16)
    CHUNK_ROWS: int = setting(0, low=0, pow2=True)
    COPY_BLOCK_C: int = setting(128, pow2=True)
    SCOPE: str = setting("sys", choices=("sys", "gpu"))
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self):
        if type(self) is AgMatmulConfig:
            raise TypeError("AgMatmulConfig holds what the variants share; build an "
                            "AgPointerConfig, AgTmaConfig or AgCopyEngineConfig")

    @property
    def chunk_rows(self) -> int:
        """Rows per gather signal (CHUNK_ROWS, with 0 meaning BLOCK_M)."""
        return self.CHUNK_ROWS or self.BLOCK_M

    def kernel_args(self) -> dict:
        """The tile and gather constexprs every ag_matmul kernel takes."""
        return dict(BLOCK_M=self.BLOCK_M, BLOCK_N=self.BLOCK_N, BLOCK_K=self.BLOCK_K,
                    GROUP_M=self.GROUP_M, NUM_COMM=self.NUM_COMM, CHUNK_ROWS=self.chunk_rows,
                    COPY_BLOCK_C=self.COPY_BLOCK_C, SCOPE=self.SCOPE)

    def to_dict(self) -> dict:
        """The fields and the selectors: a dict that resolves to this config again."""
        return dict(dataclasses.asdict(self), TMA=self.TMA, PRODUCER=self.PRODUCER)

    def replace(self, **changes: Any) -> "AgMatmulConfig":
        """This config updated by ``changes``, as the variant TMA and PRODUCER (changed
        or kept) select; settings the variants share carry over. A key of another
        variant is a ``ValueError`` naming that variant, unless its value asks nothing."""
        known = {key for v in _VARIANTS for key in v.keys()} | set(_Selectors.__annotations__)
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"jaxtdist.ag_matmul: unknown config keys {unknown}; known: "
                             f"{sorted(known)}")
        check_settings(self.OP, _Selectors, changes)
        tma, producer = changes.get("TMA", self.TMA), changes.get("PRODUCER", self.PRODUCER)
        _check_producer(tma, producer)
        target = (AgPointerConfig if not tma else
                  AgCopyEngineConfig if producer == "ce" else AgTmaConfig)
        own = set(target.keys())
        for key, value in changes.items():
            if key not in own and key not in _Selectors.__annotations__:
                _refuse_foreign(key, value, target)
        check_settings(self.OP, target, changes)
        values = {k: v for k, v in dataclasses.asdict(self).items() if k in own}
        values.update({k: v for k, v in changes.items() if k in own})
        return target(**values)

    # -- defaults -------------------------------------------------------------

    @classmethod
    def default(cls, problem: Problem, allow_tma: bool = True) -> "AgMatmulConfig":
        """One rule over every shape: decode sizes (all ranks' rows in one tile)
        push and split K (``_decode``); few row tiles take narrow N tiles so that
        the tiles still cover the SMs; large shapes take the copy-engine TMA kernel
        where the shape fits it (2.6x faster than SM producers at 128/4096/8192 and
        faster on every large shape tuned on 4 x H200; float32 too, reading w
        K-major: 2.8x faster than the pointer kernel at 4096^3 on one H100), else
        the pointer kernel's largest tile that still covers the SMs. ``allow_tma=False`` gives the
        pointer kernel's defaults (for configs that ask for its modes)."""
        m_shard, n, k = problem.shape
        world, itemsize = problem.world, problem.itemsize
        allow_tma = allow_tma and problem.vendor == "nvidia"  # TMA and copy engines
        wide = itemsize == 4
        small = world * m_shard <= _DECODE_ROWS.get(problem.platform, 32)
        pointer = AgPointerConfig
        if problem.platform != "gpu":  # the interpreter: small blocks keep it fast
            block_c = min(64, next_pow2(k))
            if small:
                return pointer(BLOCK_M=max(16, next_pow2(world * m_shard)), BLOCK_N=32,
                               BLOCK_K=32, GROUP_M=1, NUM_COMM=2, COPY_BLOCK_C=block_c,
                               ALL_ROWS=True, num_warps=4, num_stages=1)
            return pointer(BLOCK_M=min(32, max(16, next_pow2(m_shard))), BLOCK_N=32, BLOCK_K=32,
                           GROUP_M=4, NUM_COMM=2, COPY_BLOCK_C=block_c, num_warps=4,
                           num_stages=1)
        block_k = 64 if wide else 128
        if small:
            return cls._decode(problem)
        block_m = min(128, max(16, next_pow2(m_shard)))
        if m_shard <= 256:
            if (allow_tma and not wide and m_shard % 128 == 0
                    and not tma_misfit(m_shard, n, k, itemsize, 128)):
                return AgCopyEngineConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, NUM_COMM=16,
                                          CHUNK_ROWS=128, COPY_BLOCK_C=256, num_warps=8,
                                          num_stages=4)
            return pointer(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=block_k,
                           CHUNK_ROWS=min(16, block_m), COPY_BLOCK_C=256, num_warps=4,
                           num_stages=3 if wide else 4)
        if allow_tma and m_shard % 64 == 0 and not tma_misfit(m_shard, n, k, itemsize, 64):
            # The GEMM core's tile by wave quantisation (``_gemm_config``), row
            # tiles within each rank's rows.
            t = default_tiles(m_shard, world, n, k, itemsize, problem.sms, whole_row_tiles=True)
            return AgCopyEngineConfig(BLOCK_M=t.BLOCK_M, BLOCK_N=t.BLOCK_N, BLOCK_K=t.BLOCK_K,
                                      COPY_BLOCK_C=128, num_warps=t.num_warps,
                                      num_stages=t.num_stages, CHUNK_ROWS=max(256, t.BLOCK_M),
                                      SUBTILE=t.SUBTILE)
        if wide:  # float32 off TMA: 3 stages within shared memory
            return pointer(BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=32, COPY_BLOCK_C=64,
                           num_warps=8, num_stages=3)
        # The pointer kernel: the largest tile whose count still covers the SMs (a
        # GEMM of fewer tiles than SMs leaves SMs idle for its whole length).
        for block_m, block_n in _POINTER_TILES:
            if world * -(-m_shard // block_m) * -(-n // block_n) >= problem.sms:
                break
        big = block_m * block_n >= 128 * 256
        return pointer(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64, COPY_BLOCK_C=128,
                       num_warps=8 if big else 4, num_stages=3 if big else 4)

    @classmethod
    def _decode(cls, problem: Problem) -> "AgPointerConfig":
        """All ranks' rows in one M tile (decode): SM producers push each shard into
        the peers' inboxes with a signal per >= 64 KiB of rows, and split K gives
        about two resident programs per SM. The tuned 4 x H200 configs of
        16 x 4096 x 8192 and the fastest world-1 candidate of 128 x 4096 x 8192
        (47 us against 145 with a signal per row) are this rule's picks."""
        m_shard, n, k = problem.shape
        rows = problem.world * m_shard
        row_bytes = k * problem.itemsize
        chunk_rows = min(next_pow2(m_shard), next_pow2(-(-_DECODE_SIGNAL_BYTES // row_bytes)))
        n_tiles = -(-n // 64)
        split_k = max(1, min(8, _prev_pow2(2 * problem.sms // n_tiles), -(-k // 64)))
        return AgPointerConfig(BLOCK_M=max(16, next_pow2(rows)), BLOCK_N=64, BLOCK_K=64,
                               GROUP_M=1, NUM_COMM=8, CHUNK_ROWS=chunk_rows,
                               COPY_BLOCK_C=min(1024, next_pow2(k)), ALL_ROWS=True,
                               SPLIT_K=split_k, PRODUCER="push", num_warps=4,
                               num_stages=3 if problem.itemsize == 4 else 4)

    @classmethod
    def for_overrides(cls, problem: Problem, asked: Mapping[str, Any]) -> "AgMatmulConfig":
        """The defaults an override set starts from: one that turns TMA off, or asks
        for a mode only the pointer kernel has (split K, one tile over all rows, SM
        pushes), starts from the pointer kernel's defaults."""
        pointer = (not asked.get("TMA", True)) or ("TMA" not in asked and (
            asked.get("SPLIT_K", 1) != 1 or asked.get("ALL_ROWS", False)
            or asked.get("PRODUCER") == "push"))
        return cls.default(problem, allow_tma=not pointer)

    @classmethod
    def settle(cls, base: "AgMatmulConfig", asked: Mapping[str, Any]) -> "AgMatmulConfig":
        """``base`` updated by ``asked`` (``replace``); the TMA kernels' epilogue cut
        follows an asked BLOCK_N where it was not asked for."""
        cfg = base.replace(**asked)
        if isinstance(cfg, AgTmaConfig) and "SUBTILE" not in asked and "BLOCK_N" in asked:
            cfg = cfg.replace(SUBTILE=4 if cfg.BLOCK_N >= 256 else 2 if cfg.BLOCK_N >= 32 else 1)
        return cfg

    def check(self, problem: Problem) -> None:
        # SM producers signal within a row tile; the copy engines' chunks may span several.
        if self.PRODUCER != "ce" and self.chunk_rows > self.BLOCK_M:
            raise ValueError(f"jaxtdist.ag_matmul: CHUNK_ROWS={self.chunk_rows} must divide "
                             f"BLOCK_M={self.BLOCK_M}")

    # -- search space ---------------------------------------------------------

    @classmethod
    def search_space(cls, problem: Problem) -> list[dict]:
        """Overrides of the defaults worth timing on GPUs, those that fit the problem,
        each distinct (the defaults are timed once)."""
        return AgMatmulConfig.fitting(problem, _gpu_candidates(problem))


@dataclasses.dataclass(frozen=True)
class AgPointerConfig(AgMatmulConfig):
    """The pointer kernel's config (variant "pointer"; TMA=False).

    Attributes:
      PRODUCER: "sm" (producer programs stage and pull) or "push" (they push
        into the peers' heap inboxes).
      SPLIT_K: K splits of each tile.
      ALL_ROWS: one M tile over every rank's rows (decode).
    """
    variant: ClassVar[str] = "pointer"
    TMA: ClassVar[bool] = False

    PRODUCER: str = setting("sm", choices=PRODUCERS)
    SPLIT_K: int = setting(1, inert=(1,))
    ALL_ROWS: bool = setting(False, inert=(False,))

    def check(self, problem: Problem) -> None:
        m_shard, _, k = problem.shape
        _check_producer(self.TMA, self.PRODUCER)
        if self.ALL_ROWS and self.BLOCK_M < problem.world * m_shard:
            raise ValueError(f"jaxtdist.ag_matmul: ALL_ROWS needs BLOCK_M >= world * m_shard "
                             f"= {problem.world * m_shard}, got BLOCK_M={self.BLOCK_M}")
        super().check(problem)
        if self.SPLIT_K > -(-k // self.BLOCK_K):
            raise ValueError(f"jaxtdist.ag_matmul: SPLIT_K={self.SPLIT_K} exceeds the "
                             f"{-(-k // self.BLOCK_K)} blocks of K={k} (BLOCK_K={self.BLOCK_K})")


@dataclasses.dataclass(frozen=True)
class AgTmaConfig(AgMatmulConfig):
    """The persistent TMA kernel fed by SM producers (variant "tma"; TMA=True,
    PRODUCER="sm").

    Attributes:
      SUBTILE: column pieces of the output stores (1, 2 or 4; ``_gemm.store_tile``);
        follows BLOCK_N unless asked for.
    """
    variant: ClassVar[str] = "tma"
    TMA: ClassVar[bool] = True
    PRODUCER: ClassVar[str] = "sm"

    SUBTILE: int = setting(2, choices=(1, 2, 4), inert=(1,))

    def check(self, problem: Problem) -> None:
        m_shard, n, k = problem.shape
        if problem.vendor != "nvidia":
            raise ValueError(f"jaxtdist.ag_matmul: config TMA=True, PRODUCER={self.PRODUCER!r}: "
                             f"TMA loads and copy-engine pushes are NVIDIA features "
                             f"({problem.vendor} GPUs run the pointer kernel: TMA=False, "
                             "PRODUCER 'sm' or 'push')")
        if self.BLOCK_N // self.SUBTILE < 16:
            raise ValueError(f"jaxtdist.ag_matmul: config SUBTILE={self.SUBTILE!r} must be 1, 2 "
                             f"or 4 with BLOCK_N / SUBTILE >= 16 (BLOCK_N={self.BLOCK_N})")
        super().check(problem)
        if misfit := tma_misfit(m_shard, n, k, problem.itemsize, self.BLOCK_M):
            raise ValueError(f"jaxtdist.ag_matmul: config TMA=True needs {misfit}")


@dataclasses.dataclass(frozen=True)
class AgCopyEngineConfig(AgTmaConfig):
    """The persistent TMA kernel with every SM in the GEMM, fed by the copy engines
    (variant "ce"; TMA=True, PRODUCER="ce").

    Attributes:
      STREAM_K, TAIL_SPLIT_N, TAIL_STAGES, FLATTEN: the last wave's cut along K
        or N, its pieces' pipeline depth, and the flattened tile loops ("auto":
        where measured to pay).
      PUSH_ORDER: pushes to every peer at once ("parallel") or one after another
        ("serial", the default).
    """
    variant: ClassVar[str] = "ce"
    PRODUCER: ClassVar[str] = "ce"

    STREAM_K: Any = setting("auto", kind="bool", auto=True, inert=("auto", False))
    TAIL_SPLIT_N: Any = setting("auto", kind="int", pow2=True, auto=True, inert=("auto", 1),
                                note="(pieces per tile of the last wave; 1: whole tiles)")
    TAIL_STAGES: Any = setting("auto", kind="int", auto=True, inert=("auto",),
                               note="(pipeline depth of the split-N tail's pieces)")
    FLATTEN: Any = setting("auto", kind="bool", auto=True, inert=("auto", False))
    PUSH_ORDER: str = setting("serial", choices=PUSH_ORDERS, inert=("parallel",),
                              note="(copy engines push to every peer at once, or to one peer "
                                   "after another)")

    def check(self, problem: Problem) -> None:
        pieces = self.TAIL_SPLIT_N
        if pieces != "auto" and pieces > 1:
            if self.STREAM_K is True:
                raise ValueError(f"jaxtdist.ag_matmul: config STREAM_K=True and TAIL_SPLIT_N="
                                 f"{pieces} both cut the last wave (along K, along N); ask for one")
            if self.BLOCK_N // pieces < 16:
                raise ValueError(f"jaxtdist.ag_matmul: config TAIL_SPLIT_N={pieces} cuts "
                                 f"BLOCK_N={self.BLOCK_N} into pieces narrower than 16 columns; "
                                 "lower it")
        if self.FLATTEN is True and self.chunk_rows < self.BLOCK_M:
            raise ValueError(f"jaxtdist.ag_matmul: config FLATTEN=True needs CHUNK_ROWS >= "
                             f"BLOCK_M (one flag per row tile), got CHUNK_ROWS={self.chunk_rows}, "
                             f"BLOCK_M={self.BLOCK_M}")
        super().check(problem)


_VARIANTS = (AgPointerConfig, AgTmaConfig, AgCopyEngineConfig)
# The setting a dict selects each variant by, as errors name it.
_SELECTS = {"pointer": "TMA=False", "tma": "TMA=True", "ce": "PRODUCER='ce', TMA=True"}


def _check_producer(tma: bool, producer: str) -> None:
    """PRODUCER "ce" needs the TMA kernel, "push" the pointer kernel."""
    if producer == "ce" and not tma:
        raise ValueError("jaxtdist.ag_matmul: config PRODUCER='ce' needs TMA=True (the copy "
                         "engines feed the persistent TMA kernel only)")
    if producer == "push" and tma:
        raise ValueError("jaxtdist.ag_matmul: config PRODUCER='push' needs TMA=False (SM pushes "
                         "feed the pointer kernel only; the TMA kernel's pushes are "
                         "PRODUCER='ce')")


def _refuse_foreign(key: str, value: Any, target: type[AgMatmulConfig]) -> None:
    """A ``key`` that ``target`` lacks: checked against the variants that have it, and
    refused, naming them, unless its value asks nothing of them."""
    owners = [v for v in _VARIANTS if key in v.keys()]
    field = next(f for f in dataclasses.fields(owners[0]) if f.name == key)
    check_setting(AgMatmulConfig.OP, field, value)
    if value not in field.metadata.get("inert", ()):
        raise ValueError(f"jaxtdist.ag_matmul: config {key}={value!r} needs "
                         f"{_SELECTS[owners[0].variant]} (a setting of the "
                         f"{' and '.join(v.variant for v in owners)} kernel"
                         f"{'s' if len(owners) > 1 else ''} only; this config runs the "
                         f"{target.variant} kernel)")


def _gpu_candidates(problem: Problem) -> list[dict]:
    m_shard, _, _ = problem.shape
    rows = problem.world * m_shard
    if problem.itemsize == 4:
        return [{}] + [dict(NUM_COMM=c) for c in (4, 8, 16, 32)]
    if rows <= _DECODE_ROWS["gpu"]:  # decode: one tile over all rows; split K to fill the GPU
        # Producers push into peers' inboxes (one NVLink crossing, no wait), a flag per 4 rows.
        push4 = dict(PRODUCER="push", CHUNK_ROWS=4, COPY_BLOCK_C=1024)
        return [{},
                dict(SPLIT_K=1, BLOCK_N=32, BLOCK_K=256),
                dict(SPLIT_K=8, BLOCK_N=128),
                dict(NUM_COMM=8, CHUNK_ROWS=4, COPY_BLOCK_C=1024),
                dict(NUM_COMM=32),
                dict(SPLIT_K=2, BLOCK_N=32),
                dict(PRODUCER="push"),
                dict(push4, NUM_COMM=8),
                dict(PRODUCER="push", SPLIT_K=2, BLOCK_N=32),
                # One wave: producers plus split-K tiles within what the SMs hold at once.
                dict(push4, NUM_COMM=4, BLOCK_N=128, BLOCK_K=128, SPLIT_K=4, num_stages=3),
                dict(push4, NUM_COMM=4, BLOCK_N=64, BLOCK_K=128, SPLIT_K=2, num_stages=3),
                dict(push4, NUM_COMM=8, BLOCK_N=64, BLOCK_K=64, SPLIT_K=4),
                dict(push4, NUM_COMM=8, BLOCK_N=128, BLOCK_K=64, SPLIT_K=8),
                dict(push4, NUM_COMM=8, BLOCK_N=64, BLOCK_K=64, SPLIT_K=4, num_stages=6),
                dict(push4, NUM_COMM=4, BLOCK_N=64, BLOCK_K=64, SPLIT_K=4),
                dict(push4, NUM_COMM=8, BLOCK_N=32, BLOCK_K=128, SPLIT_K=2),
                dict(push4, NUM_COMM=8, BLOCK_N=128, BLOCK_K=32, SPLIT_K=8),
                dict(PRODUCER="push", NUM_COMM=4, BLOCK_N=64, SPLIT_K=2),
                dict(PRODUCER="push", NUM_COMM=4, BLOCK_N=32, BLOCK_K=256, SPLIT_K=1)]
    if m_shard <= 256:  # few row tiles: narrower N tiles, finer chunks
        block_m = min(128, max(16, next_pow2(m_shard)))
        sm = dict(TMA=False, PRODUCER="sm", ALL_ROWS=False, BLOCK_M=block_m, BLOCK_N=64,
                  BLOCK_K=128, GROUP_M=8, NUM_COMM=16, CHUNK_ROWS=min(16, block_m),
                  COPY_BLOCK_C=256, num_warps=4, num_stages=4)
        ce = dict(TMA=True, PRODUCER="ce", BLOCK_K=64, num_stages=4)
        return [{}, sm, dict(sm, NUM_COMM=32), dict(sm, CHUNK_ROWS=32, NUM_COMM=8),
                dict(sm, BLOCK_N=128, BLOCK_K=64), dict(sm, SPLIT_K=2, BLOCK_N=128, BLOCK_K=64),
                dict(sm, PRODUCER="push"),
                dict(ce, BLOCK_M=128, BLOCK_N=128, CHUNK_ROWS=128, num_warps=8),
                dict(ce, BLOCK_M=128, BLOCK_N=64, CHUNK_ROWS=128, num_warps=4),
                dict(ce, BLOCK_M=64, BLOCK_N=128, CHUNK_ROWS=64, num_warps=4),
                dict(ce, BLOCK_M=128, BLOCK_N=128, CHUNK_ROWS=128, num_warps=8,
                     PUSH_ORDER="parallel")]
    # Large: pointer-GEMM variations, the TMA kernel with SM producers, and the
    # copy-engine kernel's chunkings, tails and push orders.
    ce = dict(TMA=True, PRODUCER="ce")
    return [{},
            dict(CHUNK_ROWS=32, NUM_COMM=24),
            dict(COPY_BLOCK_C=256, num_stages=4),
            dict(TMA=True),
            dict(TMA=True, CHUNK_ROWS=32, NUM_COMM=24),
            dict(TMA=True, NUM_COMM=8),
            dict(TMA=True, BLOCK_N=128, num_stages=4, CHUNK_ROWS=32),
            dict(ce, CHUNK_ROWS=128),
            dict(ce, CHUNK_ROWS=256),
            dict(ce, CHUNK_ROWS=512),
            # Coarse chunks: fewer driver calls where the host paces back-to-back calls.
            dict(ce, CHUNK_ROWS=1024),
            dict(ce, CHUNK_ROWS=256, GROUP_M=16),
            dict(ce, CHUNK_ROWS=256, STREAM_K=True),
            dict(ce, CHUNK_ROWS=256, STREAM_K=False),
            dict(ce, CHUNK_ROWS=256, PUSH_ORDER="parallel"),
            dict(ce, CHUNK_ROWS=128, PUSH_ORDER="parallel")]


# -- the copy-engine kernel's last wave ------------------------------------------

def stream_k_tail(tiles: int, programs: int, k_blocks: int, peer_tiles: int,
                  mode=True) -> tuple[int, int]:
    """(tail tiles, K blocks per run) of the copy-engine kernel's stream-K tail, or (0, 0).

    ``tiles`` dealt round-robin over ``programs`` leave ``tiles % programs``
    in a last, partial wave: those programs take a whole tile's time while
    the others idle. Cutting the tail's ``tail * k_blocks`` K blocks into
    equal runs, one per program, ends that wave after ``tail / programs`` of
    a tile instead. Runs are at least a quarter of a tile (at most five
    programs sum one tile); the tail must lie in peers' tiles (the kernel's
    local tiles are dealt first). ``mode="auto"`` cuts only where runs are at
    most ``_STREAM_K_AUTO_MAX_RUN`` of a tile.

    Example:
      >>> stream_k_tail(704, 132, 64, 528)  # 2048 x 2752 tiles of 128 x 256, K=4096
      (44, 22)
    """
    tail = tiles % programs
    if mode is False or tail == 0 or tail > peer_tiles or k_blocks < 2:
        return 0, 0
    run = max(-(-tail * k_blocks // programs), -(-k_blocks // 4))
    if run >= k_blocks or (mode == "auto" and run > _STREAM_K_AUTO_MAX_RUN * k_blocks):
        return 0, 0
    return tail, run


def tail_stages(cfg: dict, num_stages: int, pieces: int) -> int:
    """The pipeline depth of the split-N tail's pieces (config TAIL_STAGES).

    "auto": as deep as fits in the shared memory that the whole tiles' pipeline
    and epilogue already take (a piece's stage is narrower), and never shallower
    than num_stages. A piece reads as much of A as a whole tile for a fraction
    of the MMAs, so its loads want more of them in flight: on 4 x H200 (docs/perf,
    runs AW-AX) 2048/2752/4096 took 256-258 us with 6 stages against 262-265
    with the kernel's 3 (and 288-293 with 2).

    Example:
      >>> tail_stages(dict(TAIL_STAGES="auto", BLOCK_M=128, BLOCK_N=256, BLOCK_K=64), 3, 2)
      6
    """
    if cfg["TAIL_STAGES"] != "auto":
        return int(cfg["TAIL_STAGES"])
    block_m, block_n, block_k = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    # In elements of the operands' dtype (the output's too): the same for all three.
    whole = num_stages * (block_m + block_n) * block_k + block_m * block_n // cfg.get("SUBTILE", 1)
    piece_stage = (block_m + block_n // pieces) * block_k
    return max(num_stages, whole // piece_stage)


def flattens(cfg: dict, tiles: int, programs: int) -> bool:
    """Whether the copy-engine kernel flattens its tile loops (config FLATTEN).

    "auto" flattens where chunks are no finer than tiles (one flag per tile,
    which the loop-free wait needs) and programs average at least
    ``_FLATTEN_AUTO_MIN_TILES`` tiles: with one tile each there is no next
    tile to prefetch, only the fused loop's overhead.

    Example:
      >>> flattens(dict(FLATTEN="auto", CHUNK_ROWS=128, BLOCK_M=128), 704, 132)
      True
    """
    if cfg["FLATTEN"] != "auto":
        return bool(cfg["FLATTEN"])
    return cfg["CHUNK_ROWS"] >= cfg["BLOCK_M"] and tiles >= _FLATTEN_AUTO_MIN_TILES * programs


def split_n_tail(tiles: int, programs: int, peer_tiles: int, block_n: int,
                 mode="auto") -> tuple[int, int]:
    """(tail tiles, pieces per tile) of the copy-engine kernel's split-N tail, or (0, 1).

    The ``tiles % programs`` tiles of the last, partial wave are cut along N
    into ``pieces`` (BLOCK_N / pieces wide), one piece per program, where
    all of them fit in one wave and pieces are at least 16 columns wide: the
    wave then takes a piece's time instead of a tile's, with no partial sums.
    ``mode``: a power of 2 (1: whole tiles), or "auto" (2).

    Example:
      >>> split_n_tail(704, 132, 528, 256)  # 2048 x 2752 tiles of 128 x 256
      (44, 2)
    """
    pieces = 2 if mode == "auto" else int(mode)
    tail = tiles % programs
    if (pieces < 2 or tail == 0 or tail > peer_tiles or tail * pieces > programs
            or block_n // pieces < 16):
        return 0, 1
    return tail, pieces


