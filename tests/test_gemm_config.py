"""The GEMM core's default tiles (``ops/_gemm_config``): the wave rule on its own."""

from __future__ import annotations

import pytest

from jaxtdist.ops._gemm_config import default_tiles, stages_for, tile_cost, tma_fits


@pytest.mark.parametrize("rows,world,n,k,expected", [
    (8192, 1, 8192, 3584, (128, 256)),   # 2048 tiles: 15.5 rounds, the big tile wins
    (2048, 1, 3072, 4096, (64, 256)),    # 192 tiles of 128 x 256 = 1.45 rounds: 18% saved
    (8192, 1, 1280, 8192, (64, 256)),    # 2.4 rounds against 4.8 of half the tiles
    (512, 1, 3584, 4096, (128, 128)),    # one round either way: twice the tiles
    (4096, 1, 3072, 4096, (128, 256)),   # 2.9 rounds: nothing to save
    (512, 1, 5120, 5120, (128, 256)),    # 80 tiles: one round beats two of smaller tiles
    (16, 1, 4096, 8192, (64, 64)),       # decode rows: 64-row tiles only, enough of them
    (2048, 4, 3584, 4096, (128, 256)),   # every rank's rows count
])
def test_default_tiles_follow_the_waves(rows, world, n, k, expected):
    t = default_tiles(rows, world, n, k, 2, 132)
    assert (t.BLOCK_M, t.BLOCK_N) == expected
    # One warpgroup per tile where 128 x 128 tiles fill one round (512 x 3584).
    one_round = expected == (128, 128) and world * -(-rows // 128) * -(-n // 128) <= 132
    assert t.num_warps == (8 if expected[0] == 128 and not one_round else 4)
    assert t.num_stages == (3 if expected == (128, 256) else stages_for(
        *expected, 64, 2, t.SUBTILE))
    # A smaller tile than the largest is taken only for a clear saving.
    largest = tile_cost(rows, world, n, 132, *max(
        ((bm, bn) for bm, bn in ((128, 256), (64, 256), (64, 128), (64, 64))
         if bm == 64 or rows > 64), key=lambda s: s[0] * s[1]))
    assert tile_cost(rows, world, n, 132, *expected) <= largest or expected == (128, 128)


def test_float32_keeps_tiles_narrow_and_stages_fit():
    t = default_tiles(4096, 1, 4096, 4096, 4, 132)
    assert t.BLOCK_N <= 128 and t.BLOCK_K == 32
    for bm, bn, bk, size in ((128, 256, 64, 2), (128, 128, 64, 2), (128, 128, 32, 4)):
        for sub in (1, 2, 4):
            stages = stages_for(bm, bn, bk, size, sub)
            assert 2 <= stages <= 5
            assert stages == 2 or (bm + bn) * bk * size * stages + bm * bn // sub * size <= 216 << 10
    # Subtiling the 128 x 256 epilogue in four makes room for a 4th stage.
    assert stages_for(128, 256, 64, 2, 4) == 4 > stages_for(128, 256, 64, 2, 1)


def test_tma_fits_needs_16_byte_rows():
    assert tma_fits(4096, 4096, 2) and tma_fits(12, 4, 4)
    assert not tma_fits(33, 4096, 2) and not tma_fits(4096, 20, 2)
