"""Default tiles of the GEMM core (``kernels/_gemm.py``), one rule for every matmul op.

A persistent GEMM runs its tiles in rounds of one tile per SM: a last round
that is only partly full costs as much as a full one. The rule takes, among a
few tile shapes, the one whose rounds cost least, counting each tile's work at
the rate an SM reaches on that shape (a larger tile reuses more of each byte
it loads, so it runs closer to the tensor cores' peak):

    cost(bm, bn) = ceil(tiles(bm, bn) / SMs) * bm * bn / rate(bm, bn)

and keeps the largest tile unless a smaller one saves a clear margin. Where
even 128 x 128 tiles fill at most one round, the GEMM lasts one tile: the
rule takes 128 x 128, the most tiles without a second round.

Tiles count every rank's rows separately (a tile never spans two ranks'
rows). The pipeline depth follows from shared memory: as many stages of
(BLOCK_M + BLOCK_N) x BLOCK_K operands as fit beside the epilogue's buffer,
which ``store_tile`` cuts along N (SUBTILE) to make room for one more stage.
"""

from __future__ import annotations

import dataclasses

# Relative rate of one SM on a tile shape (bf16/f16), fitted to the tile sweep of
# ``python -m jaxtdist.bench gemm --sweep`` on 1 x H100 (19 model shapes): 128 x
# 256 (8 warps, two warpgroups of 64 rows) is the fastest Triton tile; 64 x 256
# ran at about 0.95 of its rate where both filled their rounds (it won at 2048 x
# 7168 x 4096 and 1024 x 9472 x 3584, 6% and 11% faster, lost where 128 x 256
# filled its rounds), 128 x 128 at 0.8-0.95, 64 x 128 at about 0.6. A smaller
# tile is taken only where its rounds cost at least ``_SWITCH_GAIN`` less.
TILE_RATES = {(128, 256): 1.0, (64, 256): 0.95, (128, 128): 0.85, (64, 128): 0.6,
              (64, 64): 0.4}
_SWITCH_GAIN = 0.05
# Pipeline depth caps per tile: 128 x 256 ran as fast or faster with 3 stages
# than with the 4 that fit (8 of 9 shapes of the sweep, by 0-2%).
_MAX_STAGES = {(128, 256): 3}
# Shared memory a GEMM program may plan for (Hopper allows 227 KiB per block;
# Triton needs some for barriers and layout conversions).
SMEM_BUDGET = 216 << 10
MAX_STAGES = 5


@dataclasses.dataclass(frozen=True)
class GemmTiles:
    """A tile, its launch options and its epilogue cut (``store_tile``'s SUBTILE)."""
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int
    num_stages: int
    SUBTILE: int


def tma_fits(k: int, n: int, itemsize: int) -> bool:
    """Whether TMA can address the rows of x [*, k] and w / out [*, n] (16-byte
    multiples); otherwise the ops fall back to their pointer GEMM."""
    return k * itemsize % 16 == 0 and n * itemsize % 16 == 0


def weights_k_major(itemsize: int, tma: bool) -> bool:
    """Whether a TMA GEMM reads w [k, n] through its transpose [n, k] (the kernels'
    ``B_T``; the op passes ``w.T``): for float32, whose TF32 wgmma reads B only
    K-major (an N-major B tile is rewritten in shared memory at every K step, which
    made float32 GEMMs 5-6x cuBLAS's time on one H100). The transpose is one pass
    over w."""
    return tma and itemsize == 4


def _tiles(rows: int, world: int, n: int, bm: int, bn: int) -> int:
    return world * -(-rows // bm) * -(-n // bn)


def tile_cost(rows: int, world: int, n: int, sms: int, bm: int, bn: int) -> float:
    """Rounds of SM-wide waves times one tile's work at its rate (see module doc)."""
    return -(-_tiles(rows, world, n, bm, bn) // sms) * bm * bn / TILE_RATES[(bm, bn)]


def stages_for(bm: int, bn: int, bk: int, itemsize: int, subtile: int,
               epilogue_itemsize: int | None = None, max_stages: int = MAX_STAGES) -> int:
    """Pipeline stages that fit the shared-memory budget beside the epilogue's buffer
    (of ``epilogue_itemsize`` bytes per element: the operands' by default; 4 where
    the kernel may store float32 partials), at most ``max_stages``."""
    stage = (bm + bn) * bk * itemsize
    epilogue = bm * bn // subtile * (epilogue_itemsize or itemsize)
    return max(2, min(max_stages, (SMEM_BUDGET - epilogue) // stage))


def default_tiles(rows: int, world: int, n: int, k: int, itemsize: int, sms: int,
                  whole_row_tiles: bool = False) -> GemmTiles:
    """The GEMM core's tile for ``world`` blocks of ``rows`` x n outputs over k.

    Args:
      rows: output rows per rank (each rank's rows tile on their own).
      world: ranks whose rows one launch computes (1 for a local GEMM).
      n, k: output columns and contraction length.
      itemsize: bytes per operand element (4: float32 keeps tiles <= 128 wide).
      sms: SMs the persistent grid gets.
      whole_row_tiles: only tiles whose BLOCK_M divides ``rows`` (kernels whose
        row tiles must not reach into the next rank's rows); ``rows`` must be a
        multiple of 64.
    """
    wide = itemsize == 4
    shapes = [s for s in TILE_RATES if not (wide and s[1] > 128)]
    if rows <= 64:  # decode-sized rows: no point in 128-row tiles
        shapes = [s for s in shapes if s[0] == 64]
    if whole_row_tiles:
        shapes = [s for s in shapes if rows % s[0] == 0]
    one_round = ((128, 256) in shapes and (128, 128) in shapes
                 and _tiles(rows, world, n, 128, 128) <= sms)
    if one_round:
        # One round that leaves half the SMs idle in 128 x 256: a tile's latency is
        # the GEMM's, and twice the tiles of 128 x 128 ran 1.14x jnp.dot against
        # 1.2x for 128 x 256 and 64 x 256 at 512 x 3584 x 4096.
        bm, bn = 128, 128
    else:
        # Largest tile first; a smaller one must save _SWITCH_GAIN of the best cost.
        shapes.sort(key=lambda s: -s[0] * s[1] * TILE_RATES[s])
        bm, bn = shapes[0]
        best = tile_cost(rows, world, n, sms, bm, bn)
        for s in shapes[1:]:
            cost = tile_cost(rows, world, n, sms, *s)
            if cost < (1 - _SWITCH_GAIN) * best:
                (bm, bn), best = s, cost
    bk = 32 if wide else 64
    subtile = 4 if bn == 256 else 2
    stages = min(stages_for(bm, bn, bk, itemsize, subtile), _MAX_STAGES.get((bm, bn), MAX_STAGES))
    # 128-row tiles take two warpgroups (8 warps ran as fast or faster than 4 for
    # 128 x 128 on every shape of the sweep, several rounds each), except in one
    # round of 128 x 128 tiles: there one warpgroup per tile ran 2-6% faster on all
    # six shapes of ``probe_defaults.py gemm_one_round`` (1 x H100; 512 x 3584 x
    # 4096: 1.12x jnp.dot against 1.16x, 256 x 4096 x 4096: 1.13x against 1.20x).
    warps = 8 if bm == 128 and not one_round else 4
    return GemmTiles(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                     num_stages=stages, SUBTILE=subtile)
