"""Default tiles of the GEMM core (``kernels/_gemm.py``), one rule for every matmul op.

A persistent GEMM runs its tiles in rounds of one tile per SM: a last round
that is only partly full costs as much as a full one. The rule takes, among a
few tile shapes, the one whose rounds cost least, counting each tile's work at
the rate an SM reaches on that shape (a larger tile reuses more of each byte
it loads, so it runs closer to the tensor cores' peak):

    cost(bm, bn) = ceil(tiles(bm, bn) / SMs) * bm * bn / rate(bm, bn)

and keeps the largest tile unless a smaller one saves a clear margin.

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
# ran at 0.92-0.94 of its rate, 128 x 128 (4 warps) at 0.8-0.95, 64 x 128 at
# about 0.6. A smaller tile is taken only where its rounds cost at least
# ``_SWITCH_GAIN`` less (8192 x 1280 x 8192 predicted 9% less for 64 x 256 and
# ran 1.32x slower: the rates are leads, not laws).
TILE_RATES = {(128, 256): 1.0, (64, 256): 0.92, (128, 128): 0.85, (64, 128): 0.6,
              (64, 64): 0.4}
_SWITCH_GAIN = 0.10
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


def tile_cost(rows: int, world: int, n: int, sms: int, bm: int, bn: int) -> float:
    """Rounds of SM-wide waves times one tile's work at its rate (see module doc)."""
    tiles = world * -(-rows // bm) * -(-n // bn)
    return -(-tiles // sms) * bm * bn / TILE_RATES[(bm, bn)]


def stages_for(bm: int, bn: int, bk: int, itemsize: int, subtile: int) -> int:
    """Pipeline stages that fit the shared-memory budget beside the epilogue's buffer."""
    stage = (bm + bn) * bk * itemsize
    epilogue = bm * bn // subtile * itemsize
    return max(2, min(MAX_STAGES, (SMEM_BUDGET - epilogue) // stage))


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
    # Largest tile first; a smaller one must save _SWITCH_GAIN of the best cost so far.
    shapes.sort(key=lambda s: -s[0] * s[1] * TILE_RATES[s])
    bm, bn = shapes[0]
    best = tile_cost(rows, world, n, sms, bm, bn)
    for s in shapes[1:]:
        cost = tile_cost(rows, world, n, sms, *s)
        if cost < (1 - _SWITCH_GAIN) * best:
            (bm, bn), best = s, cost
    bk = 32 if wide else 64
    subtile = 4 if bn == 256 else 2
    # 128 x 256 needs two warpgroups for its accumulator; 128 x 128 ran faster on one.
    return GemmTiles(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=8 if bn * bm > 128 * 128
                     else 4, num_stages=stages_for(bm, bn, bk, itemsize, subtile),
                     SUBTILE=subtile)
